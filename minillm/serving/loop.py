"""The engine on a thread of its own: HTTP handlers submit and abort requests, the thread steps the engine.

The engine is not thread-safe, so exactly one thread touches it. Handlers (on the asyncio event loop)
put commands on a queue; the engine thread applies them between steps (a request that arrives while a
step runs joins the next one: continuous batching across HTTP requests), passes each new token through
the request's ``OutputProcessor`` (text, stop strings, log-prob labels) and hands the result to the
request's stream with ``call_soon_threadsafe``. While nothing is waiting or running it sleeps on the
queue instead of spinning. Each step is one ENGINE turn of ``turns``: the event loop's passes run between
steps, never inside one (``turns`` says why).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..engine import Engine, Request
from .limits import ServerLimits, Slot
from .output import OutputProcessor, RequestOutput
from .protocol import ApiError
from .records import Records
from .turns import ENGINE, Turns

log = logging.getLogger("minillm.serving")


class RequestStream:
    """One request's ``RequestOutput`` s, as an async iterator that ends after the last one (or raises the
    error that ended it). It holds the request's admission slot until the engine has ended the request.

    Its consumer takes an output, sends it, and comes back for the next; while a send waits for a client
    that does not read (its connection's buffers are full), outputs pile up here. At most ``limit`` may:
    one more aborts the request, so the engine works for such a client only as far as its buffers and
    ``limit`` outputs hold, and the client, if it reads again, finds an error event after them."""

    def __init__(self, owner: EngineLoop, request_id: str, slot: Slot, limit: int):
        self.owner, self.request_id, self.slot, self.limit = owner, request_id, slot, limit
        self.loop = asyncio.get_running_loop()
        self.outputs: deque[RequestOutput | Exception] = deque()
        self.ready = asyncio.Event()
        self.sending = False  # the consumer is sending the output it took last, not waiting for the next
        self.ended = False  # the engine has ended the request (the event loop's view)
        self.closing = False  # asked the engine to end it

    def deliver(self, item: RequestOutput | Exception | None) -> None:
        """Called on the engine thread: an output, the error that ended the request, or None (it ended
        without a word for its client: aborted)."""
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _put(self, item: RequestOutput | Exception | None) -> None:
        if item is None or isinstance(item, Exception) or item.finished:
            self.ended = True
            self.slot.release()  # the engine's work is done, whether or not the client reads the rest
        if item is not None:
            self.outputs.append(item)
            self.ready.set()
        if self.sending and len(self.outputs) > self.limit and not self.ended and not self.closing:
            self.outputs.append(ApiError(408, f"the client took none of the last {self.limit} outputs of its stream "
                                              "while its connection's buffers were full; the request was aborted",
                                         code="stream_not_read"))
            self.close()  # the engine stops working for a client that does not read

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self.sending = False
        while not self.outputs:
            if self.ended:
                raise StopAsyncIteration
            self.ready.clear()
            await self.ready.wait()
        item = self.outputs.popleft()
        if isinstance(item, Exception):
            raise item
        self.sending = True
        return item

    def close(self) -> None:
        """End the request in the engine if it has not ended (its client left, or does not read)."""
        if not self.ended and not self.closing:
            self.closing = True
            self.owner.commands.put(Abort(self.request_id, "client"))


@dataclass(frozen=True)
class Submit:
    request: Request
    processor: OutputProcessor
    stream: RequestStream
    received: float  # time.perf_counter() when the server received it


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True)
class FailAll:
    """End every waiting and running request with ``error`` (the server is shutting down); keep serving."""

    error: Exception


class EngineLoop:
    """Owns an ``Engine`` and the thread that drives it (``start`` / ``stop``). ``stats`` is the engine's
    load after the latest step or command; ``records`` the records of the latest ended requests. Each step,
    with its outputs' text and delivery, is one ENGINE turn of ``turns``."""

    def __init__(self, engine: Engine, turns: Turns, max_buffered_outputs: int = ServerLimits.max_buffered_outputs):
        self.engine, self.turns, self.max_buffered = engine, turns, max_buffered_outputs
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[str, tuple[OutputProcessor, RequestStream]] = {}  # engine thread only
        self.records = Records()
        self.stats = engine.load()
        self.thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End what is left, end the thread."""
        self.commands.put(None)
        self.thread.join(timeout)

    def submit(self, request: Request, processor: OutputProcessor, slot: Slot, received: float) -> RequestStream:
        """Queue ``request`` (call on the event loop; ``engine.rejection`` has passed it), whose stream takes
        ``slot``; ``received``: ``time.perf_counter()`` when it reached the server."""
        stream = RequestStream(self, request.request_id, slot, self.max_buffered)
        self.commands.put(Submit(request, processor, stream, received))
        return stream

    def fail_all(self, error: Exception) -> None:
        self.commands.put(FailAll(error))

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            commands = []
            try:  # block only when idle; between steps take whatever has arrived
                commands.append(self.commands.get(block=not self.engine.has_unfinished()))
                while True:
                    commands.append(self.commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if command is None:
                    return self._end_all(RuntimeError("the server is shutting down"))
                if isinstance(command, Submit):
                    self._add(command)
                elif isinstance(command, Abort):
                    self._end(command.request_id, command.reason, None)
                else:
                    self._end_all(command.error)
            if self.engine.has_unfinished():
                with self.turns.turn(ENGINE):
                    self._step()
            self.stats = self.engine.load()

    def _add(self, command: Submit) -> None:
        # it arrived when the server received it, not when this thread got to it after the step in flight
        arrival = self.engine.clock() - (time.perf_counter() - command.received)
        try:
            self.engine.add_request(command.request, arrival_time=arrival)
        except ValueError as error:
            return command.stream.deliver(error)
        self.requests[command.request.request_id] = (command.processor, command.stream)

    def _step(self) -> None:
        try:
            result = self.engine.step()
        except Exception as error:  # fail the requests in flight, keep serving
            log.exception("engine step failed")
            return self._end_all(RuntimeError(f"engine step failed: {error!r}"))
        for record in result.ended:
            self.records.keep(record)
        for out in result.outputs:
            processor, stream = self.requests[out.request_id]
            output = processor.process(out)
            if out.finished:
                del self.requests[out.request_id]
            elif output.finished:  # a stop string: the engine's request ends here, its blocks freed
                self._end(out.request_id, "stop", None)
            stream.deliver(output)

    def _end(self, request_id: str, reason: str, word: Exception | None) -> None:
        """End a waiting or running request early (``reason``: "client", "stop" or "error")."""
        record = self.engine.abort(request_id, reason)
        if record is not None:
            self.records.keep(record)
        _, stream = self.requests.pop(request_id, (None, None))
        if stream is not None and reason != "stop":
            stream.deliver(word)

    def _end_all(self, error: Exception) -> None:
        for request_id in list(self.requests):
            self._end(request_id, "error", error)
