"""The HTTP front door: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, a health
endpoint, and the engine's own records of finished requests, as a FastAPI app over one ``EngineLoop``.

A request's life: bytes -> validated body (``protocol``) -> prompt token ids -> ``engine.rejection``
(a request that can never fit is refused with 400 here, never queued) -> ``EngineLoop.submit`` -> one
``StepOutput`` per token -> incremental detokenization -> one server-sent event per token (or one JSON
body at the end). A client that leaves mid-request has its request aborted, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from ..engine import Engine, Request
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


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template; a tokenizer without one (the tiny model's) gets ``role: content`` lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class Frontend:
    """Turns validated requests into engine requests, and engine outputs into OpenAI response bodies."""

    def __init__(self, tokenizer, loop: EngineLoop, model_name: str):
        self.tokenizer, self.loop, self.model_name = tokenizer, loop, model_name
        self.max_total = loop.engine.max_total_tokens  # the longest prompt + reply the engine accepts

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if body.prompt in ("", []):
            raise ApiError(400, "prompt is empty; give some text or token ids", param="prompt")
        return list(body.prompt) if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], int]:
        """(prompt ids, max_tokens); without a limit the reply may fill what the context leaves."""
        ids = chat_prompt_ids(self.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
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
                          ignore_eos=body.ignore_eos, seed=body.seed)
        reason = self.loop.engine.rejection(request)  # reads only constants (config, pool size): thread-safe
        if reason is not None:
            in_prompt = reason.startswith(("empty", "token id"))
            param = ("messages" if shape.chat else "prompt") if in_prompt else "max_tokens"
            raise ApiError(400, f"this request can never be served: {reason}", param=param)
        return request

    async def respond(self, http: HTTPRequest, body: SamplingRequest, shape: Shape, request: Request,
                      received: float):
        """``received``: ``time.perf_counter()`` when the handler started, the request's arrival."""
        if body.stream:
            return StreamingResponse(self.events(body, shape, request, received), media_type="text/event-stream")
        return await self.whole(http, body, shape, request, received)

    def envelope(self, shape: Shape, request_id: str, created: int, choices: list, stream: bool, **extra) -> dict:
        return {"id": request_id, "object": shape.chunk_object if stream else shape.full_object, "created": created,
                "model": self.model_name, "choices": choices, **extra}

    async def events(self, body: SamplingRequest, shape: Shape, request: Request, received: float):
        """The server-sent events of one request: a chunk per token, then usage if asked, then [DONE].
        The request reaches the engine when the response starts streaming."""
        created, text_stream, n_out = int(time.time()), TextStream(self.tokenizer), 0
        stream = self.loop.submit(request, received)
        null_usage = {"usage": None} if body.include_usage else {}
        prompt_ids = {"prompt_token_ids": request.prompt_ids} if body.return_token_ids else {}
        try:
            if shape.chat:  # OpenAI's first chat chunk names the role
                yield sse(self.envelope(shape, request.request_id, created, [shape.choice("", None, True, role=True)],
                                        True, **null_usage, **prompt_ids))
            async for out in stream:
                text = "".join(text_stream.push(t) for t in out.new_token_ids)
                text += text_stream.flush() if out.finished else ""
                choice = shape.choice(text, FINISH_REASONS.get(out.finish_reason), True)
                if body.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
                    if n_out == 0 and not shape.chat:
                        choice.update(prompt_ids)
                n_out += len(out.new_token_ids)
                yield sse(self.envelope(shape, request.request_id, created, [choice], True, **null_usage))
            if body.include_usage:
                yield sse(self.envelope(shape, request.request_id, created, [], True,
                                        usage=usage(len(request.prompt_ids), n_out)))
            yield sse("[DONE]")
        except Exception as error:  # the engine failed this request (cancellation is not an Exception)
            yield sse(ApiError(500, str(error)).body())
        finally:
            stream.close()  # the client left (or the engine failed): abort, freeing the KV blocks

    async def whole(self, http: HTTPRequest, body: SamplingRequest, shape: Shape, request: Request,
                    received: float):
        """Wait for the last token, or for the client to leave (then abort), and answer in one body."""
        stream = self.loop.submit(request, received)

        async def collect():
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
            return JSONResponse({}, status_code=499)  # the client left: nobody is listening
        outputs = collecting.result()  # re-raises an engine failure
        ids = [t for out in outputs for t in out.new_token_ids]
        choice = shape.choice(self.tokenizer.decode(ids), FINISH_REASONS.get(outputs[-1].finish_reason), False)
        extra = {}
        if body.return_token_ids:
            choice["token_ids"] = ids
            (extra if shape.chat else choice)["prompt_token_ids"] = request.prompt_ids
        return JSONResponse(self.envelope(shape, request.request_id, int(time.time()), [choice], False,
                                          usage=usage(len(request.prompt_ids), len(ids)), **extra))


def record_dict(record) -> dict:
    """An engine ``RequestRecord`` as JSON (times: seconds on the engine's clock)."""
    return {"id": record.request_id, "status": record.status, "reason": record.reason,
            "prompt_tokens": record.prompt_len, "completion_tokens": len(record.output_ids),
            "arrival_time": record.arrival_time, "token_times": record.token_times,
            "finish_time": record.finish_time, "preemptions": record.preemptions}


def create_app(tokenizer, engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` (its thread starts and stops with the app)."""
    loop = EngineLoop(engine)
    frontend, started = Frontend(tokenizer, loop, model_name), int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="minillm", summary="an OpenAI-compatible server for minillm's engine", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

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
        received = time.perf_counter()
        body = parse_body(await http.body(), CompletionRequest)
        frontend.check_model(body.model)
        request = frontend.engine_request(body, COMPLETION, frontend.completion_prompt(body), body.max_tokens)
        return await frontend.respond(http, body, COMPLETION, request, received)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        received = time.perf_counter()
        body = parse_body(await http.body(), ChatCompletionRequest)
        frontend.check_model(body.model)
        request = frontend.engine_request(body, CHAT, *frontend.chat_prompt(body))
        return await frontend.respond(http, body, CHAT, request, received)

    @app.get("/minillm/requests")
    async def finished_requests():
        """minillm's extension: the engine's own records of the latest finished or aborted requests."""
        return {"requests": [record_dict(r) for r in loop.finished_records()]}

    return app
