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
(``minillm.fast.precision.load_precision``): int4 is the GGUF file's own 4-bit weights, so the tiny model,
which has no file, takes float32, bfloat16 or int8 (its random weights made into that variant).

Limits (flags, see ``--help``; ``minillm.serving.limits``): a request body of at most ``--max-body-bytes``
(413), received within ``--body-timeout`` (408), at most ``--max-transit-bytes`` of bodies received or parsed
at once (503); a connection's next request headers within ``--header-timeout`` (the connection is closed); a
response whose client takes nothing for ``--send-timeout`` is abandoned; ``--max-waiting`` requests queued
beyond those running (then 429 with ``Retry-After``).

Shutdown: SIGTERM or Ctrl-C stops admitting (503), gives the streams in flight ``--shutdown-timeout``
seconds to finish, ends the others with an error event and ``data: [DONE]``, and exits 0.

Exit status: 0 after a clean shutdown (SIGTERM, Ctrl-C), 2 for a bad argument (a KV pool that cannot be
allocated included), 3 when a package is missing (``minillm.cli_common``), 4 when the port is already in use.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
import threading

import torch

from ..analysis.arithmetic import kv_bytes_per_token
from ..cli_common import (
    BAD_ARGUMENT,
    NOT_INSTALLED,
    add_model_args,
    check_model_args,
    int_range,
    load_or_exit,
    seconds,
    weights_text,
)
from ..engine import Engine, EngineConfig
from ..engine.config import DEFAULT_TOKENS_PER_SEQUENCE

SERVED_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "tiny"}  # --model -> the name served
PORT_IN_USE = 4
PROG = "python -m minillm serve"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from .limits import ServerLimits  # needs the serve extra, as the server does

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a minillm model over an OpenAI-compatible HTTP API (continuous batching "
                    "across concurrent requests).")
    add_model_args(parser)
    parser.add_argument("--served-model-name", default=None,
                        help=f"the name clients ask for (default: {SERVED_NAMES['smollm2']!r}, or 'tiny')")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    parser.add_argument("--port", type=int_range(0, 65535), default=8000, help="default 8000")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random weights (default 0)")
    parser.add_argument("--max-batch-size", type=int_range(1), default=8,
                        help="most requests running at once (default 8)")
    parser.add_argument("--num-blocks", type=int_range(1), default=None,
                        help=f"KV blocks in the pool (default: the engine's, max-batch-size sequences of the "
                             f"context, at most {DEFAULT_TOKENS_PER_SEQUENCE} tokens each)")
    parser.add_argument("--block-size", type=int_range(1), default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="a step's token budget (chunked prefill; default: the engine's)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="share KV blocks of common prefixes")
    parser.add_argument("--max-body-bytes", type=int_range(1), default=ServerLimits.max_body_bytes,
                        help="largest request body in bytes; a larger one gets a 413 (default 4 MiB)")
    parser.add_argument("--max-transit-bytes", type=int_range(1), default=ServerLimits.max_transit_bytes,
                        help="bytes of request bodies being received or parsed at once; more get a 503 with "
                             "Retry-After (default 16 MiB)")
    parser.add_argument("--body-timeout", type=seconds(), default=30.0,
                        help="seconds to receive a request's body, else 408 (default 30)")
    parser.add_argument("--header-timeout", type=seconds(), default=ServerLimits.header_timeout,
                        help="seconds for a connection's next request headers, from its opening or its last "
                             "response, else it is closed (default 10)")
    parser.add_argument("--send-timeout", type=seconds(), default=ServerLimits.send_timeout,
                        help="seconds a response may wait for its client to take bytes, else the request is "
                             "aborted and the connection closed (default 10)")
    parser.add_argument("--max-waiting", type=int_range(0), default=128,
                        help="requests that may wait beyond the max-batch-size running; more get a 429 with "
                             "Retry-After (default 128)")
    parser.add_argument("--max-messages", type=int_range(1), default=512,
                        help="most chat messages in a request (default 512)")
    parser.add_argument("--shutdown-timeout", type=seconds(zero_ok=True), default=5.0,
                        help="on SIGTERM, seconds the streams in flight may take to finish before they are "
                             "ended with an error event (default 5)")
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when standard input closes (minillm.serving.launch_server uses it, so that "
                             "a server never outlives the notebook or test that started it)")
    args = parser.parse_args(argv)
    try:
        check_model_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def server_limits(args: argparse.Namespace):
    from .limits import ServerLimits

    return ServerLimits(max_body_bytes=args.max_body_bytes, max_transit_bytes=args.max_transit_bytes,
                        body_timeout=args.body_timeout, header_timeout=args.header_timeout,
                        send_timeout=args.send_timeout, max_waiting=args.max_waiting, max_messages=args.max_messages,
                        shutdown_timeout=args.shutdown_timeout)


def memory_bytes(device: torch.device) -> int | None:
    """The memory a pool on ``device`` could at most use (the GPU's, or the machine's RAM), if known."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def bind_socket(host: str, port: int, send_buffer: int) -> socket.socket:
    """The listening socket, bound before the model loads (so a port in use fails fast); OSError if not.
    Its connections inherit its kernel send buffer of ``send_buffer`` bytes (Linux counts twice that)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def engine_config(args: argparse.Namespace, eos_token_id: int | None) -> EngineConfig:
    """The engine the arguments ask for; what they leave out (the pool size, the token budget) is the
    engine's default. Raises TypeError or ValueError for a bad combination."""
    return EngineConfig(max_batch_size=args.max_batch_size, num_blocks=args.num_blocks, block_size=args.block_size,
                        eos_token_id=eos_token_id, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=args.enable_prefix_caching)


def watch_stdin(server) -> None:
    """Shut down (as on SIGTERM) once standard input reaches its end (the parent closed it, or died). The
    thread reads the file descriptor itself: a daemon thread blocked in ``sys.stdin``'s buffered reader holds
    its lock, which aborts the interpreter when it exits."""
    def wait():
        while os.read(0, 65536):
            pass
        server.handle_exit(signal.SIGTERM, None)

    threading.Thread(target=wait, name="stdin-watch", daemon=True).start()


def server_class(uvicorn):
    """uvicorn.Server whose signal handler also begins the app's shutdown (``begin_shutdown``), on an event
    loop from ``loop_factory``."""
    class Server(uvicorn.Server):
        begin_shutdown = None  # the app's: stop admitting, end the streams left after --shutdown-timeout
        loop_factory = None  # the event loop's (one that takes the app's turns)

        def handle_exit(self, sig, frame) -> None:
            if self.begin_shutdown is not None:
                self.begin_shutdown()
            super().handle_exit(sig, frame)

        def run(self, sockets: list[socket.socket] | None = None) -> None:
            with asyncio.Runner(loop_factory=self.loop_factory) as runner:
                runner.run(self.serve(sockets=sockets))

    return Server


def main(argv: list[str] | None = None) -> int:
    try:
        import uvicorn

        from .app import create_app
        from .limits import MAX_HEADER_BYTES, SEND_BUFFER_BYTES, Connections, connection_protocol
        from .turns import event_loop_factory
    except ImportError as error:
        print(f"{PROG}: error: {error}; install the server's packages with: pip install 'minillm[serve]'",
              file=sys.stderr)
        return NOT_INSTALLED
    args = parse_args(argv)
    try:
        sock = bind_socket(args.host, args.port, SEND_BUFFER_BYTES)
    except OSError as error:
        in_use = error.errno == errno.EADDRINUSE
        print(f"{PROG}: error: {args.host}:{args.port} is "
              f"{'already in use (is another server running? pick another --port)' if in_use else 'unusable'}"
              f": {error.strerror or error}", file=sys.stderr)
        return PORT_IN_USE if in_use else BAD_ARGUMENT
    model, tokenizer, description = load_or_exit(PROG, args, args.seed)
    config = model.config
    try:
        engine_settings = engine_config(args, tokenizer.eos_token_id)
    except (TypeError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return BAD_ARGUMENT
    blocks = engine_settings.pool_blocks(config.max_seq_len)
    need = blocks * args.block_size * kv_bytes_per_token(config, model.dtype)
    have = memory_bytes(model.device)
    pool = f"a KV pool of {blocks} blocks x {args.block_size} tokens (--num-blocks {blocks}) needs {need} bytes " \
           f"({need / 2**30:.3g} GiB)"
    if have is not None and need > have:
        print(f"{PROG}: error: {pool}, more than the {have} bytes ({have / 2**30:.3g} GiB) of "
              f"{model.device.type} memory; use a smaller --num-blocks", file=sys.stderr)
        return BAD_ARGUMENT
    try:
        engine = Engine(model, engine_settings)
    except (TypeError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return BAD_ARGUMENT
    except (MemoryError, RuntimeError, OverflowError) as error:
        print(f"{PROG}: error: {pool}, which could not be allocated "
              f"({type(error).__name__}: {str(error)[:200]}); use a smaller --num-blocks", file=sys.stderr)
        return BAD_ARGUMENT
    num_blocks = engine.blocks.num_blocks
    name = args.served_model_name or SERVED_NAMES[args.model]
    print(f"minillm serve: {description} as {name!r} on {model.device.type}, "
          f"{torch.get_num_threads()} thread(s), {weights_text(args, model)}\n"
          f"  KV pool: {num_blocks} blocks x {args.block_size} tokens "
          f"({engine.pool.nbytes / 1e6:.0f} MB); at most {args.max_batch_size} requests running; "
          f"context {config.max_seq_len} tokens\n  OpenAI API at http://{args.host}:{args.port}/v1", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("  note: the server has no authentication; anyone who can reach this address can use it", flush=True)
    limits, connections = server_limits(args), Connections(args.header_timeout)
    app = create_app(tokenizer, engine, name, limits, host=args.host, connections=connections)
    server = server_class(uvicorn)(uvicorn.Config(
        app, host=args.host, port=args.port, http=connection_protocol(connections), access_log=not args.no_access_log,
        timeout_keep_alive=5, timeout_graceful_shutdown=args.shutdown_timeout + 5,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES))
    server.begin_shutdown, server.loop_factory = app.state.begin_shutdown, event_loop_factory(app.state.turns)
    if args.exit_with_parent:
        watch_stdin(server)
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal that stopped it once it has shut
        signal.signal(sig, lambda *_: None)  # down, to the handler it found: this one, so the exit status is 0
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
