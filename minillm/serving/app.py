"""The HTTP front door: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, a health
endpoint, and the engine's own records of finished requests, as a FastAPI app over one ``EngineLoop``.

A request's life: bytes -> validated body (``protocol``) -> prompt token ids -> ``engine.rejection``
(a request that can never fit is refused with 400 here, never queued) -> ``EngineLoop.submit`` -> one
``StepOutput`` per token -> incremental detokenization -> one server-sent event per token (or one JSON
body at the end). A client that leaves mid-request has its request aborted, which frees its KV blocks.
A request that asks for log-probs (``protocol``'s docstring) gets them from the engine with each token.

Limits (``ServerLimits``, set by ``serve``'s flags): a body larger than ``max_body_bytes`` is a 413, a body
not received within ``body_timeout`` a 408; a prompt that cannot fit the context is refused from its length
before it is tokenized; parsing, tokenizing and the chat template run on a worker thread, never on the
event loop; more than ``max_batch_size + max_waiting`` requests in flight get a 429 with ``Retry-After``;
once shutdown begins (``begin_shutdown``) new requests get a 503 and the streams still running after
``shutdown_timeout`` end with an error event and ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from ..engine import Engine, Request, TokenLogprob
from ..request import RequestSummary
from ..text.byte import ByteTokenizer
from ..text.stream import TextStream
from .loop import EngineLoop
from .protocol import (
    FINISH_REASONS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    Shape,
    parse_body,
    sse,
    usage,
)

COMPLETION, CHAT = Shape(chat=False), Shape(chat=True)
RECORDS_PAGE_MAX = 1000  # /minillm/requests: the most records one page holds
RECORDS_PAGE_TOKEN_TIMES = 200_000  # ... and the most token times (a page stops early rather than exceed it)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server (``python -m minillm serve`` sets them from its flags)."""

    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413
    body_timeout: float = 30.0  # s to receive a whole body, else 408
    max_waiting: int = 128  # requests in flight beyond max_batch_size that may wait; more get a 429
    max_messages: int = 512  # chat messages in one request
    prepare_timeout: float = 30.0  # s to parse, render the chat template and tokenize, else 503
    shutdown_timeout: float = 5.0  # s the streams running at shutdown may still take before they are ended
    retry_after: int = 1  # s, the Retry-After of a 429 or 503


def max_chars_per_token(tokenizer, vocab_size: int) -> int | None:
    """The most characters one token can stand for (so a text longer than ``n`` times this has more than
    ``n`` tokens), or None when the tokenizer cannot say. A byte tokenizer: 1 (a character is >= 1 byte)."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:
        return None
    try:  # a character is >= 1 byte of UTF-8: a token's bytes bound its characters
        return max(1, max(len(token_bytes(i)) for i in range(vocab_size)))
    except Exception:  # no bound known: only the exact check after tokenizing applies
        return None


class StopText:
    """Stop strings over a stream of text: ``push`` returns the text that is safe to send (never a part
    that could begin a stop string) and whether a stop string has appeared (the text ends before it)."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        buffer = self.held + text
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return buffer[:min(found)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buffer) + 1))
                    if buffer.endswith(s[:k])), default=0)  # a tail that may grow into a stop string
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


async def read_body(http: HTTPRequest, limit: int, timeout: float) -> bytes:
    """The request body, or ApiError 413 once it passes ``limit`` bytes (before reading it all when the
    Content-Length says so), or 408 when it has not all arrived within ``timeout`` seconds."""
    too_large = f"more than this server's limit of {limit} bytes (--max-body-bytes)"
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes, {too_large}", code="request_too_large")
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is {too_large}", code="request_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client left before sending the whole body") from None
    return b"".join(chunks)


def token_label(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(a token's text, its bytes), for log-probs: the text where the bytes are whole UTF-8, else OpenAI's
    ``bytes:\\xe4\\xbd`` (a piece of a character); a special token by its name."""
    if isinstance(tokenizer, ByteTokenizer):
        raw = bytes([token_id]) if token_id < 256 else tokenizer.token_strings([token_id])[0].encode()
    else:
        raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def decode_with_offsets(text_stream: TextStream, ids: list[int], start: int) -> tuple[str, list[int]]:
    """(the text ``ids`` complete, where the text each of them completes begins): ``start`` characters came
    before them (a piece of a character completes no text: its text is "", where the text stands)."""
    text, offsets = "", []
    for token_id in ids:
        offsets.append(start + len(text))
        text += text_stream.push(token_id)
    return text, offsets


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template; a tokenizer without one (the tiny model's) gets ``role: content`` lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class Frontend:
    """Turns validated requests into engine requests, and engine outputs into OpenAI response bodies."""

    def __init__(self, tokenizer, loop: EngineLoop, model_name: str, limits: ServerLimits = ServerLimits()):
        self.tokenizer, self.loop, self.model_name, self.limits = tokenizer, loop, model_name, limits
        self.max_total = loop.engine.max_total_tokens  # the longest prompt + reply the engine accepts
        per_token = max_chars_per_token(tokenizer, loop.engine.model.config.vocab_size)
        # a text longer than this has more tokens than any request may hold: refused before tokenizing
        self.max_prompt_chars = None if per_token is None else per_token * self.max_total
        self.max_in_flight = loop.engine.config.max_batch_size + limits.max_waiting
        self.shutting_down = False

    def check_admission(self) -> None:
        """503 once shutdown has begun; 429 while max_batch_size + max_waiting requests are in flight."""
        retry = {"Retry-After": str(self.limits.retry_after)}
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers=retry)
        if self.loop.in_flight >= self.max_in_flight:
            raise ApiError(429, f"the server is full: {self.loop.in_flight} requests in flight, at most "
                                f"{self.max_in_flight} (max_batch_size + --max-waiting); retry later",
                           code="server_overloaded", headers=retry)

    def check_text_length(self, chars: int, param: str, what: str) -> None:
        """Refuse, before tokenizing, a text that has more tokens than any request may hold."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            per_token = self.max_prompt_chars // self.max_total
            raise ApiError(400, f"{what} has {chars} characters, so at least {-(-chars // per_token)} tokens, which "
                                f"leaves no room for a reply (at most {self.max_total} tokens in all: max_seq_len "
                                "and the KV pool); refused before tokenizing", param=param,
                           code="context_length_exceeded")

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if body.prompt in ("", []):
            raise ApiError(400, "prompt is empty; give some text or token ids", param="prompt")
        if isinstance(body.prompt, list):
            if len(body.prompt) >= self.max_total:
                raise ApiError(400, f"the prompt has {len(body.prompt)} tokens, which leaves no room for a reply "
                                    f"(at most {self.max_total} tokens in all)", param="prompt",
                               code="context_length_exceeded")
            return list(body.prompt)
        self.check_text_length(len(body.prompt), "prompt", "the prompt")
        return self.tokenizer.encode(body.prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], int]:
        """(prompt ids, max_tokens); without a limit the reply may fill what the context leaves."""
        if len(body.messages) > self.limits.max_messages:
            raise ApiError(400, f"{len(body.messages)} messages, more than this server's limit of "
                                f"{self.limits.max_messages}", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages", "the messages' content")
        if getattr(self.tokenizer, "chat_template", None) and self.max_prompt_chars is not None:
            rendered = self.tokenizer.apply_chat_template(messages)  # compiled once; bounded before encoding
            self.check_text_length(len(rendered), "messages", "the chat prompt the template renders")
        ids = chat_prompt_ids(self.tokenizer, messages)
        limit = body.token_limit
        if limit is None:
            limit = self.max_total - len(ids)
            if limit < 1:
                raise ApiError(400, f"the messages take {len(ids)} tokens, which leaves no room for a reply "
                                    f"(at most {self.max_total} tokens in all)", param="messages")
        return ids, limit

    def engine_request(self, body: SamplingRequest, shape: Shape, prompt_ids: list[int], max_tokens: int) -> Request:
        """The engine's request, or ApiError(400) when the engine could never serve it."""
        request = Request(f"{shape.id_prefix}{uuid.uuid4().hex}", prompt_ids, max_tokens, sampling=body.sampling(),
                          ignore_eos=body.ignore_eos, seed=body.seed, logprobs=body.logprob_count)
        rejection = self.loop.engine.rejection(request)  # reads only constants (config, pool size): thread-safe
        if rejection is not None:
            param = ("messages" if shape.chat else "prompt") if rejection.field == "prompt" else "max_tokens"
            raise ApiError(400, f"this request can never be served: {rejection.message}", param=param)
        return request

    def prepare(self, raw: bytes, shape: Shape) -> tuple[SamplingRequest, Request]:
        """Bytes -> (validated body, engine request); ApiError for a client mistake. Runs on a worker thread."""
        body = parse_body(raw, ChatCompletionRequest if shape.chat else CompletionRequest)
        self.check_model(body.model)
        if shape.chat:
            return body, self.engine_request(body, shape, *self.chat_prompt(body))
        return body, self.engine_request(body, shape, self.completion_prompt(body), body.max_tokens)

    async def handle(self, http: HTTPRequest, shape: Shape):
        received = time.perf_counter()  # the request's arrival
        self.check_admission()  # before any work is spent on it
        raw = await read_body(http, self.limits.max_body_bytes, self.limits.body_timeout)
        try:  # parsing, the chat template and tokenizing off the event loop: other streams go on meanwhile
            body, request = await asyncio.wait_for(asyncio.to_thread(self.prepare, raw, shape),
                                                   self.limits.prepare_timeout)
        except TimeoutError:
            raise ApiError(503, f"preparing the prompt took more than {self.limits.prepare_timeout:g} s",
                           code="timeout") from None
        self.check_admission()  # again: others may have been admitted meanwhile
        return await self.respond(http, body, shape, request, received)

    async def respond(self, http: HTTPRequest, body: SamplingRequest, shape: Shape, request: Request,
                      received: float):
        """``received``: ``time.perf_counter()`` when the handler started, the request's arrival."""
        if body.stream:
            self.loop.in_flight += 1  # held for the stream from now on (its submission releases it)
            held = [True]

            def release():  # if the stream never started (the client left at once), nothing else will
                if held[0]:
                    held[0] = False
                    self.loop.in_flight -= 1

            return StreamingResponse(self.events(body, shape, request, received, release),
                                     media_type="text/event-stream", background=BackgroundTask(release))
        return await self.whole(http, body, shape, request, received)

    def logprobs(self, shape: Shape, out_logprobs: list[TokenLogprob] | None, text_offsets: list[int]) -> dict | None:
        """A choice's ``logprobs`` (None when the request asked for none)."""
        if out_logprobs is None:
            return None
        return shape.logprobs(out_logprobs, text_offsets, lambda token_id: token_label(self.tokenizer, token_id))

    def envelope(self, shape: Shape, request_id: str, created: int, choices: list, stream: bool, **extra) -> dict:
        return {"id": request_id, "object": shape.chunk_object if stream else shape.full_object, "created": created,
                "model": self.model_name, "choices": choices, **extra}

    async def events(self, body: SamplingRequest, shape: Shape, request: Request, received: float, release=None):
        """The server-sent events of one request: a chunk per token, then usage if asked, then [DONE]; an
        error event and [DONE] if it fails. The request reaches the engine when the response starts streaming."""
        created, text_stream, n_out, produced = int(time.time()), TextStream(self.tokenizer), 0, 0
        stops = StopText(body.stop_strings) if body.stop_strings else None
        if release is not None:
            release()  # the stream counts itself in flight from here
        stream = self.loop.submit(request, received)
        null_usage = {"usage": None} if body.include_usage else {}
        prompt_ids = {"prompt_token_ids": request.prompt_ids} if body.return_token_ids else {}
        try:
            if shape.chat:  # OpenAI's first chat chunk names the role
                yield sse(self.envelope(shape, request.request_id, created, [shape.choice("", None, True, role=True)],
                                        True, **null_usage, **prompt_ids))
            async for out in stream:
                text, offsets = decode_with_offsets(text_stream, out.new_token_ids, produced)
                text += text_stream.flush() if out.finished else ""
                produced += len(text)
                finish = FINISH_REASONS.get(out.finish_reason)
                if stops is not None:
                    text, stopped = stops.push(text)
                    if stopped:
                        finish = "stop"
                    elif out.finished:
                        text += stops.flush()
                choice = shape.choice(text, finish, True, logprobs=self.logprobs(shape, out.logprobs, offsets))
                if body.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
                    if n_out == 0 and not shape.chat:
                        choice.update(prompt_ids)
                n_out += len(out.new_token_ids)
                yield sse(self.envelope(shape, request.request_id, created, [choice], True, **null_usage))
                if finish == "stop" and not out.finished:
                    stream.close("stop")  # a stop string: the engine's request ends here, its blocks freed
                    break
            if body.include_usage:
                yield sse(self.envelope(shape, request.request_id, created, [], True,
                                        usage=usage(len(request.prompt_ids), n_out)))
            yield sse("[DONE]")
        except Exception as error:  # the engine failed this request (cancellation is not an Exception)
            yield sse((error if isinstance(error, ApiError) else ApiError(500, str(error))).body())
            yield sse("[DONE]")
        finally:
            stream.close()  # the client left (or the engine failed): abort, freeing the KV blocks

    async def whole(self, http: HTTPRequest, body: SamplingRequest, shape: Shape, request: Request,
                    received: float):
        """Wait for the last token, or for the client to leave (then abort), and answer in one body."""
        stream = self.loop.submit(request, received)
        stops = StopText(body.stop_strings) if body.stop_strings else None
        stopped_text: list[str] = []  # with stop strings: the text, once one has appeared

        async def collect():
            outputs, text_stream = [], TextStream(self.tokenizer)
            async for out in stream:
                outputs.append(out)
                if stops is not None:
                    text, stopped = stops.push("".join(text_stream.push(t) for t in out.new_token_ids))
                    stopped_text.append(text)
                    if stopped:
                        stream.close("stop")
                        return outputs, True
            return outputs, False

        async def client_left():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(client_left())
        try:
            done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
                stream.close()
        if collecting not in done:
            return JSONResponse({}, status_code=499)  # the client left: nobody is listening
        outputs, stopped = collecting.result()  # re-raises an engine failure
        ids = [t for out in outputs for t in out.new_token_ids]
        logprobs = None
        if request.logprobs is not None:
            _, offsets = decode_with_offsets(TextStream(self.tokenizer), ids, 0)
            logprobs = self.logprobs(shape, [lp for out in outputs for lp in out.logprobs], offsets)
        if stopped:
            choice = shape.choice("".join(stopped_text), "stop", False, logprobs=logprobs)
        else:
            choice = shape.choice(self.tokenizer.decode(ids), FINISH_REASONS.get(outputs[-1].finish_reason), False,
                                  logprobs=logprobs)
        extra = {}
        if body.return_token_ids:
            choice["token_ids"] = ids
            (extra if shape.chat else choice)["prompt_token_ids"] = request.prompt_ids
        return JSONResponse(self.envelope(shape, request.request_id, int(time.time()), [choice], False,
                                          usage=usage(len(request.prompt_ids), len(ids)), **extra))


def create_app(tokenizer, engine: Engine, model_name: str, limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The FastAPI app serving ``engine`` (its thread starts and stops with the app).

    ``app.state.begin_shutdown()`` (thread-safe; ``serve`` calls it on SIGTERM): new requests get a 503,
    and the requests still in flight ``limits.shutdown_timeout`` seconds later end with an error event."""
    loop = EngineLoop(engine)
    frontend, started = Frontend(tokenizer, loop, model_name, limits), int(time.time())
    event_loop: list[asyncio.AbstractEventLoop] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        event_loop.append(asyncio.get_running_loop())
        loop.start()
        yield
        loop.stop()

    def begin_shutdown() -> None:
        if frontend.shutting_down or not event_loop:
            return
        frontend.shutting_down = True  # read on the event loop; a plain flag, set once

        def end_streams():
            loop.fail_all(ApiError(503, "the server is shutting down", code="shutting_down"))

        event_loop[0].call_soon_threadsafe(event_loop[0].call_later, limits.shutdown_timeout, end_streams)

    app = FastAPI(title="minillm", summary="an OpenAI-compatible server for minillm's engine", lifespan=lifespan)
    app.state.engine_loop, app.state.frontend, app.state.begin_shutdown = loop, frontend, begin_shutdown

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):  # unknown path (404), wrong method (405)
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, error: Exception):  # a bug or an engine failure
        return JSONResponse(ApiError(500, f"{type(error).__name__}: {error}").body(), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **asdict(loop.stats)}

    model_card = {"id": model_name, "object": "model", "created": started, "owned_by": "minillm",
                  "max_model_len": engine.model.config.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        frontend.check_model(model_id)
        return model_card

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await frontend.handle(http, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await frontend.handle(http, CHAT)

    @app.get("/minillm/requests")
    async def finished_requests(limit: int = RECORDS_PAGE_MAX, offset: int = 0, token_times: bool = True):
        """minillm's extension: the engine's own records of the latest finished or aborted requests, a page
        at a time. ``offset`` skips that many of the newest; the page holds the next ``limit`` (at most
        ``RECORDS_PAGE_MAX``), oldest first, and stops early rather than carry more than
        ``RECORDS_PAGE_TOKEN_TIMES`` token times; ``next_offset`` (null at the end) asks for the page before."""
        if not 1 <= limit <= RECORDS_PAGE_MAX:
            raise ApiError(400, f"limit={limit} must be between 1 and {RECORDS_PAGE_MAX}", param="limit")
        if offset < 0:
            raise ApiError(400, f"offset={offset} must be >= 0", param="offset")

        def page() -> dict:  # on a worker thread: encoding a page is not the event loop's work
            kept, total = loop.finished_records()
            newest_first, times = [], 0
            for record in reversed(kept[:max(0, len(kept) - offset)]):
                if len(newest_first) == limit or (newest_first and times + len(record.token_times) >
                                                   RECORDS_PAGE_TOKEN_TIMES):
                    break
                times += len(record.token_times)
                newest_first.append(record)
            rows = [RequestSummary.of(r).to_json(token_times) for r in reversed(newest_first)]
            end = offset + len(rows)
            return {"requests": rows, "total": total, "offset": offset, "next_offset": end if end < total else None}

        return JSONResponse(await asyncio.to_thread(page))

    return app
