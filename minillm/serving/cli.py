"""``python -m minillm serve``: minillm's engine behind an OpenAI-compatible HTTP API.

    python -m minillm serve                          # SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1
    python -m minillm serve --model tiny --port 8001  # the random-weight tiny model (tests, load sweeps)
    python -m minillm serve --precision int4          # SmolLM2's own 4-bit weights from its GGUF file

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with server-sent
events or not), ``GET /v1/models``, ``GET /health`` (with the engine's load) and ``GET /minillm/requests``
(the engine's records of the latest finished requests). FastAPI + uvicorn is the stack vLLM's own
OpenAI-compatible server is built on: an asyncio server that holds thousands of open streams cheaply,
with request validation and streaming responses built in. The code is in ``minillm.serving``.

``--precision {float32,bfloat16,int8,int4}`` picks the weights as in ``python -m minillm``
(``minillm.fast.quant.load_precision``): int4 is the GGUF file's own 4-bit weights, so the tiny model,
which has no file, takes float32, bfloat16 or int8 (its random weights made into that variant).

Limits (flags, see ``--help``): a request body of at most ``--max-body-bytes`` (413), received within
``--body-timeout`` (408); request headers within ``--header-timeout`` (the connection is closed);
``--max-waiting`` requests queued beyond those running (then 429 with ``Retry-After``).

Shutdown: SIGTERM or Ctrl-C stops admitting (503), gives the streams in flight ``--shutdown-timeout``
seconds to finish, ends the others with an error event and ``data: [DONE]``, and exits 0.

Exit status: 0 after a clean shutdown (SIGTERM, Ctrl-C), 2 for a bad argument (a KV pool that cannot be
allocated included), 3 when a package is missing, 4 when the port is already in use.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import socket
import sys
import threading

import torch

from ..device import DEVICE_NAMES, DTYPES, resolve_device, resolve_dtype
from ..engine import Engine, EngineConfig
from ..engine.config import DEFAULT_TOKENS_PER_SEQUENCE
from ..fast.quant import PRECISIONS, load_precision, make_variant

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "tiny"}  # --model -> the name served
PRETRAINED = "smollm2-135m-instruct"
NOT_INSTALLED = 3
PORT_IN_USE = 4
DEFAULT_HEADER_TIMEOUT = 10.0  # s for a connection to send its request's headers


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
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="the weights: float32, bfloat16, int8 (weight-only) or int4 (smollm2 only: the GGUF "
                             "file's own 4-bit weights); instead of --dtype")
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
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="largest request body in bytes; a larger one gets a 413 (default 4 MiB)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds to receive a request's body, else 408 (default 30)")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds to receive a request's headers, else the connection is closed (default 10)")
    parser.add_argument("--max-waiting", type=int, default=128,
                        help="requests that may wait beyond the max-batch-size running; more get a 429 with "
                             "Retry-After (default 128)")
    parser.add_argument("--max-messages", type=int, default=512, help="most chat messages in a request (default 512)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="on SIGTERM, seconds the streams in flight may take to finish before they are "
                             "ended with an error event (default 5)")
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when standard input closes (minillm.serving.launch_server uses it, so that "
                             "a server never outlives the notebook or test that started it)")
    args = parser.parse_args(argv)
    if args.precision is not None and args.dtype is not None:
        parser.error(f"give --precision or --dtype, not both (--precision {args.precision} sets the dtype)")
    if args.precision == "int4" and args.model == "tiny":
        parser.error("--precision int4 is the GGUF file's own 4-bit weights, and the tiny model has no file: use "
                     "--model smollm2, or --precision float32, bfloat16 or int8")
    if args.precision is None and args.dtype is None:
        args.dtype = "float32"
    limits = (("--port", args.port, 0, 65535), ("--threads", args.threads, 1, None),
              ("--max-batch-size", args.max_batch_size, 1, None), ("--num-blocks", args.num_blocks, 1, None),
              ("--block-size", args.block_size, 1, None), ("--max-body-bytes", args.max_body_bytes, 1, None),
              ("--max-waiting", args.max_waiting, 0, None), ("--max-messages", args.max_messages, 1, None))
    for name, value, low, high in limits:
        if value is not None and (value < low or (high is not None and value > high)):
            parser.error(f"{name} {value} must be >= {low}" + (f" and <= {high}" if high is not None else ""))
    for name, value, zero_ok in (("--body-timeout", args.body_timeout, False),
                                 ("--header-timeout", args.header_timeout, False),
                                 ("--shutdown-timeout", args.shutdown_timeout, True)):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            parser.error(f"{name} {value} must be a finite number {'>=' if zero_ok else '>'} 0")
    return args


def server_limits(args: argparse.Namespace):
    from .app import ServerLimits

    return ServerLimits(max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                        max_waiting=args.max_waiting, max_messages=args.max_messages,
                        shutdown_timeout=args.shutdown_timeout)


def kv_pool_bytes(model_config, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of a KV pool (K and V, every layer) of ``num_blocks`` x ``block_size`` tokens."""
    per_token = 2 * model_config.n_layers * model_config.n_kv_heads * model_config.head_dim
    return num_blocks * block_size * per_token * torch.empty((), dtype=dtype).element_size()


def memory_bytes(device: torch.device) -> int | None:
    """The memory a pool on ``device`` could at most use (the GPU's, or the machine's RAM), if known."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (so a port in use fails fast); OSError if not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def load(args: argparse.Namespace):
    """(model, tokenizer, description) for ``--model`` in ``--dtype`` or ``--precision``."""
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype or "float32")
    if args.model == "tiny":
        from ..model import build_model
        from ..text.byte import ByteTokenizer

        model = build_model("tiny", device=device, dtype=dtype, seed=args.seed)
        if args.precision not in (None, "float32"):
            model = make_variant(model, args.precision)  # int4 was refused by parse_args: no GGUF file
        return model, ByteTokenizer(), f"the tiny model with RANDOM weights (seed {args.seed})"
    if args.precision is None:
        from ..checkpoints.pretrained import load_pretrained

        model, tokenizer = load_pretrained(PRETRAINED, device=device, dtype=dtype)
    else:
        model, tokenizer = load_precision(PRETRAINED, args.precision, device)
    return model, tokenizer, "SmolLM2-135M-Instruct"


def weights_text(args: argparse.Namespace) -> str:
    """``float32`` (the dtype), or ``precision int8`` and what it means on a line of its own."""
    return f"precision {args.precision}\n  weights: {PRECISIONS[args.precision]}" if args.precision else args.dtype


def engine_config(args: argparse.Namespace, eos_token_id: int | None) -> EngineConfig:
    """The engine the arguments ask for; what they leave out (the pool size, the token budget) is the
    engine's default. Raises TypeError or ValueError for a bad combination."""
    return EngineConfig(max_batch_size=args.max_batch_size, num_blocks=args.num_blocks, block_size=args.block_size,
                        eos_token_id=eos_token_id, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=args.enable_prefix_caching)


def watch_stdin(server) -> None:
    """Shut down (as on SIGTERM) once standard input reaches its end (the parent closed it, or died)."""
    def wait():
        sys.stdin.buffer.read()
        server.handle_exit(signal.SIGTERM, None)

    threading.Thread(target=wait, name="stdin-watch", daemon=True).start()


def server_classes(uvicorn, header_timeout: float):
    """(uvicorn.Server that shuts down gracefully and exits 0 on SIGTERM, an h11 protocol that closes a
    connection whose request headers are not complete within ``header_timeout`` seconds)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Server(uvicorn.Server):
        begin_shutdown = None  # the app's: stop admitting, end the streams left after --shutdown-timeout

        def handle_exit(self, sig, frame) -> None:
            if self.begin_shutdown is not None:
                self.begin_shutdown()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a handled SIGTERM is a clean exit (0), not re-raised

    class TimedH11Protocol(H11Protocol):
        header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # still (or again) waiting for a request's headers
            elif self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()  # headers never finished (an idle keep-alive is uvicorn's to close)

    return Server, TimedH11Protocol


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
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        in_use = error.errno == errno.EADDRINUSE
        print(f"python -m minillm serve: error: {args.host}:{args.port} is "
              f"{'already in use (is another server running? pick another --port)' if in_use else 'unusable'}"
              f": {error.strerror or error}", file=sys.stderr)
        return PORT_IN_USE if in_use else 2
    try:
        model, tokenizer, description = load(args)
    except (FileNotFoundError, ImportError) as error:
        print(f"python -m minillm serve: error: {error}", file=sys.stderr)
        return NOT_INSTALLED
    config = model.config
    try:
        engine_settings = engine_config(args, tokenizer.eos_token_id)
    except (TypeError, ValueError) as error:
        print(f"python -m minillm serve: error: {error}", file=sys.stderr)
        return 2
    blocks = engine_settings.pool_blocks(config.max_seq_len)
    need, have = kv_pool_bytes(config, blocks, args.block_size, model.dtype), memory_bytes(model.device)
    pool = f"a KV pool of {blocks} blocks x {args.block_size} tokens (--num-blocks {blocks}) needs {need} bytes " \
           f"({need / 2**30:.3g} GiB)"
    if have is not None and need > have:
        print(f"python -m minillm serve: error: {pool}, more than the {have} bytes ({have / 2**30:.3g} GiB) of "
              f"{model.device.type} memory; use a smaller --num-blocks", file=sys.stderr)
        return 2
    try:
        engine = Engine(model, engine_settings)
    except (TypeError, ValueError) as error:
        print(f"python -m minillm serve: error: {error}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError, OverflowError) as error:
        print(f"python -m minillm serve: error: {pool}, which could not be allocated "
              f"({type(error).__name__}: {str(error)[:200]}); use a smaller --num-blocks", file=sys.stderr)
        return 2
    num_blocks = engine.blocks.num_blocks
    name = args.served_model_name or MODELS[args.model]
    print(f"minillm serve: {description} as {name!r} on {model.device.type}, "
          f"{torch.get_num_threads()} thread(s), {weights_text(args)}\n"
          f"  KV pool: {num_blocks} blocks x {args.block_size} tokens "
          f"({engine.pool.nbytes / 1e6:.0f} MB); at most {args.max_batch_size} requests running; "
          f"context {config.max_seq_len} tokens\n  OpenAI API at http://{args.host}:{args.port}/v1", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("  note: the server has no authentication; anyone who can reach this address can use it", flush=True)
    app = create_app(tokenizer, engine, name, server_limits(args))
    server_class, protocol = server_classes(uvicorn, args.header_timeout)
    server = server_class(uvicorn.Config(app, host=args.host, port=args.port, http=protocol,
                                         access_log=not args.no_access_log, timeout_keep_alive=5,
                                         timeout_graceful_shutdown=args.shutdown_timeout + 5))
    server.begin_shutdown = app.state.begin_shutdown
    if args.exit_with_parent:
        watch_stdin(server)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
