"""The HTTP front door: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, a health
endpoint, and the engine's own records of ended requests, as a FastAPI app over one ``EngineLoop``.

A request's life (``Frontend.handle``): an admission slot -> its body -> on the preparation worker, the typed
body, the prompt's token ids and the engine's verdict (``prepare``) -> ``EngineLoop.submit`` -> one
``RequestOutput`` per step (text, stop strings and log-probs already done by its ``OutputProcessor``) -> one
server-sent event each (or one JSON body at the end). A client that leaves mid-request has its request
aborted, which frees its KV blocks. What a client may cost the server is ``limits``' business.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from ..engine import Engine, Request
from .limits import Admission, Bodies, Boundary, Connections, Preparer, ServerLimits
from .loop import EngineLoop, RequestStream
from .output import OutputProcessor, RequestOutput
from .prepare import Prepare
from .protocol import ApiError, EndpointFormat, SamplingRequest, request_error, sse, usage
from .records import PAGE_DEFAULT, PAGE_MAX, PAGE_TOKEN_TIMES
from .turns import Turns

COMPLETION, CHAT = EndpointFormat(chat=False), EndpointFormat(chat=True)


class Frontend:
    """Turns HTTP requests into engine requests, and their outputs into OpenAI response bodies."""

    def __init__(self, tokenizer, loop: EngineLoop, model_name: str, limits: ServerLimits):
        self.tokenizer, self.loop, self.model_name, self.limits = tokenizer, loop, model_name, limits
        self.admission = Admission(loop.engine.config.max_batch_size + limits.max_waiting, limits.retry_after)
        self.bodies, self.preparer = Bodies(limits), Preparer()
        self.prepare = Prepare(tokenizer, loop.engine, model_name, limits)

    async def handle(self, http: HTTPRequest, endpoint: EndpointFormat):
        received = time.perf_counter()  # the request's arrival
        slot = self.admission.admit()  # 429 or 503 before anything is read
        try:
            async with self.bodies.read(http) as raw:  # 413, 408, 503; its bytes count until it is parsed
                body, request = await self.prepared(raw, endpoint)
            stream = self.loop.submit(request, OutputProcessor(self.tokenizer, body.stop_strings), slot, received)
        except BaseException:
            slot.release()
            raise
        if body.stream:
            return StreamingResponse(self.events(body, endpoint, request, stream), media_type="text/event-stream",
                                     background=BackgroundTask(stream.close))  # a client gone before it began
        return await self.whole(http, body, endpoint, request, stream)

    async def prepared(self, raw: bytes, endpoint: EndpointFormat) -> tuple[SamplingRequest, Request]:
        """The typed body and the engine's request, made on the preparation worker (smallest body first)."""
        try:
            return await asyncio.wait_for(self.preparer.run(len(raw), self.prepare, raw, endpoint.chat),
                                          self.limits.prepare_timeout)
        except TimeoutError:
            raise ApiError(503, f"preparing the prompt took more than {self.limits.prepare_timeout:g} s",
                           code="timeout", headers={"Retry-After": str(self.limits.retry_after)}) from None

    def envelope(self, endpoint: EndpointFormat, request: Request, choices: list, stream: bool, **extra) -> dict:
        return {"id": request.request_id, "object": endpoint.chunk_object if stream else endpoint.full_object,
                "created": int(time.time()), "model": self.model_name, "choices": choices, **extra}

    async def events(self, body: SamplingRequest, endpoint: EndpointFormat, request: Request, stream: RequestStream):
        """The server-sent events of one request: a chunk per step's tokens, then usage if asked, then [DONE];
        an error event and [DONE] if it fails."""
        null_usage = {"usage": None} if body.include_usage else {}
        prompt_ids = {"prompt_token_ids": request.prompt_ids} if body.return_token_ids else {}
        n_out = 0
        try:
            if endpoint.chat:  # OpenAI's first chat chunk names the role
                role = endpoint.choice("", None, True, role=True)
                yield sse(self.envelope(endpoint, request, [role], True, **null_usage, **prompt_ids))
            async for out in stream:
                choice = endpoint.choice(out.text, out.finish_reason, True, logprobs=endpoint.logprobs(out.logprobs))
                if body.return_token_ids:
                    choice |= {"token_ids": out.token_ids} | (prompt_ids if n_out == 0 and not endpoint.chat else {})
                n_out += len(out.token_ids)
                yield sse(self.envelope(endpoint, request, [choice], True, **null_usage))
            if body.include_usage:
                yield sse(self.envelope(endpoint, request, [], True, usage=usage(len(request.prompt_ids), n_out)))
            yield sse("[DONE]")
        except Exception as error:  # the engine failed this request (cancellation is not an Exception)
            yield sse((error if isinstance(error, ApiError) else ApiError(500, str(error))).body())
            yield sse("[DONE]")
        finally:
            stream.close()  # the client left (or the engine failed): abort, freeing the KV blocks

    async def whole(self, http: HTTPRequest, body: SamplingRequest, endpoint: EndpointFormat, request: Request,
                    stream: RequestStream):
        """Wait for the last output, or for the client to leave (then abort), and answer in one body."""
        async def collect() -> list[RequestOutput]:
            return [out async for out in stream]

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
            return Response(status_code=499)  # the client left: nobody is listening
        outputs = collecting.result()  # re-raises an engine failure
        ids = [t for out in outputs for t in out.token_ids]
        logprobs = None if request.logprobs is None else [lp for out in outputs for lp in out.logprobs]
        choice = endpoint.choice("".join(out.text for out in outputs), outputs[-1].finish_reason, False,
                                 logprobs=endpoint.logprobs(logprobs))
        extra = {}
        if body.return_token_ids:
            choice["token_ids"] = ids
            (extra if endpoint.chat else choice)["prompt_token_ids"] = request.prompt_ids
        return JSONResponse(self.envelope(endpoint, request, [choice], False,
                                          usage=usage(len(request.prompt_ids), len(ids)), **extra))


def create_app(tokenizer, engine: Engine, model_name: str, limits: ServerLimits = ServerLimits(),  # noqa: B008
               host: str = "127.0.0.1", connections: Connections | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (its thread starts and stops with the app); ``host``: the address it
    listens on; ``connections``: the header deadlines of ``limits.connection_protocol``, if it is used.

    ``app.state.begin_shutdown()`` (thread-safe; ``serve`` calls it on SIGTERM): new requests get a 503,
    and the requests still in flight ``limits.shutdown_timeout`` seconds later end with an error event."""
    loop = EngineLoop(engine, Turns(), limits.max_buffered_outputs)
    frontend, started = Frontend(tokenizer, loop, model_name, limits), int(time.time())
    event_loop: list[asyncio.AbstractEventLoop] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        event_loop.append(asyncio.get_running_loop())
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)  # the event loop goes on taking turns while the engine thread ends

    def begin_shutdown() -> None:
        if frontend.admission.closing or not event_loop:
            return
        frontend.admission.closing = True  # read on the event loop; a plain flag, set once

        def end_streams():
            loop.fail_all(ApiError(503, "the server is shutting down", code="shutting_down"))

        event_loop[0].call_soon_threadsafe(event_loop[0].call_later, limits.shutdown_timeout, end_streams)

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Boundary, host=host, send_timeout=limits.send_timeout, connections=connections)
    app.state.engine_loop, app.state.frontend, app.state.begin_shutdown = loop, frontend, begin_shutdown
    app.state.turns = loop.turns  # for the event loop that serves the app (``turns.event_loop_factory``)

    @app.exception_handler(Exception)
    async def error_response(_, error: Exception) -> JSONResponse:  # OpenAI's error body for every error
        if isinstance(error, RequestValidationError):  # a body or a query parameter of the wrong type
            error = request_error(error.errors())
        elif isinstance(error, HTTPException):  # an unknown path (404), a wrong method (405)
            error = ApiError(error.status_code, str(error.detail))
        elif not isinstance(error, ApiError):  # a bug or an engine failure
            error = ApiError(500, f"{type(error).__name__}: {error}")
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    for kind in (ApiError, RequestValidationError, HTTPException):
        app.exception_handler(kind)(error_response)

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
        frontend.prepare.check_model(model_id)
        return model_card

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await frontend.handle(http, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await frontend.handle(http, CHAT)

    @app.get("/minillm/requests")
    async def ended_requests(limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX), offset: int = Query(0, ge=0),
                             token_times: bool = True):
        """minillm's extension: the engine's own records of the latest ended requests, a page at a time.
        ``offset`` skips that many of the newest; the page holds the next ``limit`` (at most ``PAGE_MAX``),
        oldest first, and stops early rather than carry more than ``PAGE_TOKEN_TIMES`` token times;
        ``next_offset`` (null at the end) asks for the page before. Rendered on the preparation worker."""
        cost = 30 * PAGE_TOKEN_TIMES if token_times else 200 * limit  # about its bytes, at most
        page = await frontend.preparer.run(cost, loop.records.page, offset, limit, token_times)
        return Response(page, media_type="application/json")

    return app
